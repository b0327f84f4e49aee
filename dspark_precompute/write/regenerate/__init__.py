"""Stage 5, regeneration: the target rewrites the dataset's responses on a serving engine before capture.

DSpark drafts learn the target's own answers, so the paper regenerates every response with the
target (non-thinking). Each assistant turn is asked of an OpenAI-compatible server (``client``)
with the run's sampling (``request``); recorded tool results are put back in place (``splice``);
the engine's token ids are checked against our rendering (``boundaries``); every finished row goes
to an fsynced log keyed by the source row's content (``store``), so a killed run re-asks only what
is missing and the output holds one row per source row in source order; counts and rejects are
``accounting``; which engine and model wrote the rows is ``engine``; ``stage`` drives them (the
run joins it to capture: :func:`dspark_precompute.write.plan.regenerated.regenerate_stage`).
"""
