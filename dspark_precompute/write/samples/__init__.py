"""Stage 4, rows to samples: finding and reading data files (data.py), chat templates and mask rules
(chat.py), encoding rows in worker processes (encode.py) and tokenizing the selection (tokenize.py).
"""
