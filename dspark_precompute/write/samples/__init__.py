"""Stage 4, rows to samples: finding the data (files.py), reading its rows (rows.py, with json_scan.py for
JSON arrays), normalizing them into conversations or rejects (normalize.py), chat templates and mask rules
(chat.py), encoding rows in worker processes (encode.py) and tokenizing the selection (tokenize.py).
"""
