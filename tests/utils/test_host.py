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
