"""The main job: train a set of schemes, evaluate, analyse, and write the report
(`extrapolab sweep`, `extrapolab demo`), and `extrapolab eval RUN` on one trained run."""
