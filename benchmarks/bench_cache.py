"""The prefix cache benchmark under pytest-benchmark; the measurements live in legacy_engine/bench.py
(`legacy-engine bench cache MODEL.gguf`).

    python -m pytest benchmarks/bench_cache.py --benchmark-enable     # tiny-moe (make-model, Q8_0), 947 tokens
"""
from legacy_engine.tools.bench import bench_cache


def test_cache_ttft(benchmark, tmp_path_factory):
    """tiny-moe (make-model defaults), 947 tokens: the whole bench_cache run is the timed call; its numbers go to
    extra_info."""
    import pytest
    from legacy_engine.tools.make_model import make_model
    pytest.importorskip("pytest_benchmark")
    path = make_model("tiny-moe", str(tmp_path_factory.mktemp("bench_cache") / "tiny-moe.gguf"), progress=False)
    disk = str(tmp_path_factory.mktemp("bench_cache_disk"))
    res = benchmark.pedantic(bench_cache, args=(path,), kwargs=dict(lengths=(947,), disk_dir=disk), rounds=1,
                             iterations=1)
    r = res["L947"]
    benchmark.extra_info.update({k: v for k, v in res.items() if not isinstance(v, dict)})
    benchmark.extra_info.update(r)
    assert all(v for k, v in r.items() if k.endswith("_equal"))
    # an exact repeat restores the end-of-prompt entry (all 947); the others the largest snapshot of the grid (896)
    assert r["repeat_reused"] == 947 and r["follow_reused"] == 896 and r["shared_reused"] == 896

