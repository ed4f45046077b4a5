"""Synthetic long-context tasks: one home for the generators and scorers that the alignment study and
the extension study both use (passkey, key-value retrieval, RULER's offline tasks)."""
