"""The calculator tool: exact results, and refusals for unsafe or oversized expressions."""

from __future__ import annotations

import time

import pytest

from hybridflow.tools import ToolError
from hybridflow.tools.calculator import CalculatorConfig, CalculatorTool, evaluate_expression
from tests.tools.helpers import run


@pytest.mark.parametrize(("expression", "expected"), [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("7 / 2", 3.5),
    ("7 // 2", 3),
    ("-7 % 3", 2),
    ("2 ** 10", 1024),
    ("2 ** -2", 0.25),
    ("-(3 - 5)", 2),
    ("sqrt(16) + abs(-3)", 7.0),
    ("round(2.567, 2)", 2.57),
    ("max(3, 9, 4) - min(3, 9, 4)", 6),
    ("10 ** 400 // 10 ** 398", 100),
])
def test_results(expression, expected):
    assert evaluate_expression(expression) == expected


@pytest.mark.parametrize(("expression", "message"), [
    ("9**9**9", "exponent 387420489 is too large; the limit is 10000"),
    ("2 ** 5000", "2**5000 is too large; results are limited to 4096 bits"),
    ("10**1000 * 10**1000", "result is too large; integers are limited to 4096 bits"),
    ("1.5 ** 5000", "numeric overflow"),
    ("1 / 0", "division by zero"),
    ("sqrt(-1)", "math error: math domain error"),
    ("(-8) ** 0.5", "complex number"),
    ("__import__('os').system('ls')", "unknown function \"__import__('os').system\""),
    ("(1).__class__", "unsupported syntax '1 .__class__'"),
    ("open('/etc/passwd')", "unknown function 'open'"),
    ("x + 1", "unsupported syntax 'x'"),
    ("'a' * 3", "unsupported literal 'a'"),
    ("True + 1", "unsupported literal True"),
    ("[1, 2]", "unsupported syntax '[1, 2]'"),
    ("1 +", "could not parse '1 +'"),
    ("1" * 501, "expression has 501 characters; the limit is 500"),
    ("round(1, -999999999)", "round(x, -999999999): n is limited to +-1233 digits"),  # would compute 10**999999999
    ("round(1.5, 10 ** 9)", "n is limited to +-1233 digits"),
])
def test_refusals(expression, message):
    with pytest.raises(ToolError) as info:
        evaluate_expression(expression)
    assert message in str(info.value)


def test_tool_formats_numbers_and_reports_errors_as_text():
    tool = CalculatorTool({"type": "native", "significant_digits": 6})
    assert tool.name == "calculator"

    async def calls():
        instance_id = await tool.create()
        return [await tool.execute(instance_id, {"expression": e}) for e in ("(3 + 4) * 2 ** 3 / sqrt(16)",
                                                                             "1/3", "2**100", "9**9**9")]

    results = run(calls())
    assert [response.text for response, _, _ in results[:3]] == ["14", "0.333333", str(2 ** 100)]
    assert results[3][0].text == "Error from tool 'calculator': exponent 387420489 is too large; the limit is 10000"
    assert [metrics["error"] for _, _, metrics in results] == [False, False, False, True]


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown config keys \['max_digits'\]"):
        CalculatorTool({"max_digits": 3})
    with pytest.raises(ValueError, match=r"config.type='mcp' is not supported; use 'native'"):
        CalculatorTool({"type": "mcp"})
    with pytest.raises(ValueError, match="max_int_bits must be <= 14000"):
        CalculatorConfig(max_int_bits=100_000)


def test_costly_calls_are_refused_up_front_and_the_event_loop_stays_free():
    """`round(1, -999999999)` ran for more than 30 s on the driver's event loop; now it is refused at once, the
    evaluation runs in a worker thread, and the largest allowed round() is cheap."""
    tool = CalculatorTool({"timeout_s": 5})

    async def calls():
        instance_id = await tool.create()
        start = time.monotonic()
        refused = await tool.execute(instance_id, {"expression": "round(1, -999999999)"})
        largest = await tool.execute(instance_id, {"expression": "round(10 ** 1233, -1233)"})
        return refused, largest, time.monotonic() - start

    (refused, _, metrics), (largest, _, _), elapsed = run(calls())
    assert refused.text.startswith("Error from tool 'calculator': round(x, -999999999)") and metrics["error"]
    assert metrics["timeout"] is False and largest.text == str(10 ** 1233)
    assert elapsed < 2.0, elapsed  # milliseconds when idle; the bound only catches a real stall
