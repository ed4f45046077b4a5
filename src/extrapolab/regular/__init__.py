"""RegularGPT and the regular-language length-generalisation benchmark (Chi 2024 thesis ch. 6,
docs/protocols.md). Library entry points (the CLI `extrapolab regular ...` wraps them):

* tasks:     ``make_task(name, **opts)``, ``TASKS``, ``DELETANG``, ``BHATTACHARYA``
* models:    ``RegularGPT(RegularGPTConfig(...))``, ``build_model(kind, vocab, classes, **opts)``
* training:  ``RegularRunConfig``, ``run(cfg, out_dir)``, ``load_run(dir)``, ``evaluate_lengths``
* tables:    ``regular_table(out, ...)`` (Table 6.1), ``sweep_p(out, ...)`` (Table 6.2)
* analysis:  ``pca_figure(run_dir, out)`` (Fig. 6.3), ``lemma_artifact(out)`` (Lemma 6.1),
             ``benchmark(lengths, C)`` (sliding-dilated vs full attention speed)
"""
from .baselines import MODEL_KINDS, RecurrentClassifier, TransformerClassifier, build_model
from .regular_gpt import RegularGPT, RegularGPTConfig, chunk_attention, num_levels
from .tasks import BHATTACHARYA, DELETANG, TASKS, make_task
from .train import RegularRunConfig, evaluate_lengths, fit, load_run, run

__all__ = [
    "MODEL_KINDS", "RecurrentClassifier", "TransformerClassifier", "build_model",
    "RegularGPT", "RegularGPTConfig", "chunk_attention", "num_levels",
    "BHATTACHARYA", "DELETANG", "TASKS", "make_task",
    "RegularRunConfig", "evaluate_lengths", "fit", "load_run", "run",
]
