"""Synthetic long-context tasks: one home for the generators and scorers that the alignment study and
the extension study both use.

:mod:`.retrieval` passkey (Mohtashami & Jaggi 2023) and key-value lines (Li et al. 2023): prompts
fitted to a length in any tokenizer's tokens, optionally inside a chat template, and exact-match
scoring by greedy decoding; :mod:`.ruler` RULER's offline tasks (Hsieh et al. 2024). This package
knows no softmax temperature: a caller that scores at tau != 1 passes the context that applies it.
"""
