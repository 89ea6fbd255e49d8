"""Host description: the CPU model and SIMD flags read from /proc/cpuinfo text."""

from __future__ import annotations

from hybridflow.utils.host import cpu_model, cpu_simd_flags, describe_host

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n\nprocessor\t: 1\n"
XEON = "model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\nflags\t: avx2 fma avx512f avx512bw\n"


def test_model_and_flags_come_from_cpuinfo():
    assert cpu_model(EPYC) == "AMD EPYC 7B12"
    assert cpu_simd_flags(EPYC) == ["avx2", "fma"]
    assert cpu_simd_flags(XEON) == ["avx2", "fma", "avx512f"]
    assert "(no AVX-512)" in describe_host(EPYC) and "(no AVX-512)" not in describe_host(XEON)
    assert describe_host(XEON).startswith("Intel(R) Xeon(R) CPU @ 2.20GHz, ")


def test_results_file_holds_the_rows_and_the_host(tmp_path):
    import json

    from hybridflow.utils.host import write_results

    path = write_results("probe", {"threads": 2}, [{"tok_s": 1.5}], [0.5, 0.4, 0.3], directory=tmp_path)
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and path.name.startswith("probe_")
    assert record["rows"] == [{"tok_s": 1.5}] and record["config"] == {"threads": 2}
    assert record["load_before"] == [0.5, 0.4, 0.3] and len(record["load_after"]) == 3
    assert {"cpu_model", "cpu_flags", "cpu_count", "torch"} <= set(record["host"])
