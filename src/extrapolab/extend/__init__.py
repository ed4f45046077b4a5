"""The training-free context-extension study on pretrained models (`extrapolab extend hf:PATH`, also
spelled `extrapolab align rope hf:PATH`).

:mod:`.study` runs it (resumable stages); :mod:`.cells` is one method at one length (E1/E3/E4 from
the same forwards, teacher-forced passkey, the ERF); :mod:`.plan` the bookkeeping (which cells
coincide, what holds, which methods go on); :mod:`.report` and :mod:`.figures` the tables, figures
and report. Algorithm 1's temperatures come from :mod:`extrapolab.align.onepass`, the passkey prompts
from :mod:`extrapolab.tasks.retrieval`.
"""
