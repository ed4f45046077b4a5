"""`python -m extrapolab` is `extrapolab`."""
from .cli.main import app

app(prog_name="extrapolab")
