"""The `calculator` tool: arithmetic expressions evaluated by a whitelisting AST walker (never eval/exec).

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses, the constants `pi` and `e`,
and the functions in `_FUNCTIONS`. Caps on the expression length, the exponent, `round`'s digits and the size
of every intermediate integer keep a call cheap: `9**9**9` and `round(1, -999999999)` (which computes
10**999999999) are refused before any work is done. The tool evaluates in a worker thread, off the event loop,
under the tool's `timeout_s` (`hybridflow.tools.base`).
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.tools.base import BaseTool, ToolError, ToolInstance, build_tool_config
from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorConfig", "CalculatorTool", "evaluate_expression", "format_number"]

Number = int | float

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
    "exp": math.exp, "log": math.log, "log10": math.log10, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "min": min, "max": max,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
_MAX_PRINTABLE_INT_BITS = 14_000  # sys.int_info.default_max_str_digits = 4300 decimal digits ~ 14,284 bits


@dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """Limits of the calculator tool (the YAML entry's `config:`)."""

    max_expression_chars: int = 500
    """Longer expressions are refused."""

    max_exponent: int = 10_000
    """Largest absolute exponent of `**`."""

    max_int_bits: int = 4096
    """Largest integer (in bits, about 1,233 decimal digits) any step may produce."""

    significant_digits: int = 12
    """Float results are shown with this many significant digits (`2.0` shows as `2`)."""

    def __post_init__(self) -> None:
        for name in ("max_expression_chars", "max_exponent", "max_int_bits", "significant_digits"):
            if getattr(self, name) <= 0:
                raise ValueError(f"calculator config.{name} must be > 0, got {getattr(self, name)}")
        if self.max_int_bits > _MAX_PRINTABLE_INT_BITS:
            raise ValueError(f"calculator config.max_int_bits must be <= {_MAX_PRINTABLE_INT_BITS} (Python prints "
                             f"ints of at most 4300 digits), got {self.max_int_bits}")


class _Evaluator:
    """Walks a parsed expression, computing only whitelisted nodes within the configured caps."""

    def __init__(self, config: CalculatorConfig) -> None:
        self.config = config

    def visit(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"unsupported literal {node.value!r}; only numbers are allowed")
            return self._checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            left, right = self.visit(node.left), self.visit(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._checked(_BINARY_OPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            return self._checked(_UNARY_OPS[type(node.op)](self.visit(node.operand)))
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if isinstance(node, ast.Call):
            return self._call(node)
        raise ToolError(f"unsupported syntax {ast.unparse(node)!r}; use numbers, + - * / // % **, parentheses, "
                        f"the constants {sorted(_CONSTANTS)} and the functions {sorted(_FUNCTIONS)}")

    def _call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            raise ToolError(f"unknown function {ast.unparse(node.func)!r}; available: {sorted(_FUNCTIONS)}")
        if node.keywords:
            raise ToolError(f"{node.func.id}() takes positional arguments only")
        args = [self.visit(arg) for arg in node.args]
        if node.func.id == "round" and len(args) == 2:
            if not isinstance(args[1], int):
                raise ToolError("round(x, n) needs an integer n")
            # round(int, -n) computes 10**n: bound n by the digits of the largest integer allowed
            max_digits = int(self.config.max_int_bits * math.log10(2))
            if abs(args[1]) > max_digits:
                raise ToolError(f"round(x, {args[1]}): n is limited to +-{max_digits} digits")
        try:
            return self._checked(_FUNCTIONS[node.func.id](*args))
        except TypeError as err:
            raise ToolError(f"bad arguments to {node.func.id}(): {err}") from err

    def _check_power(self, base: Number, exponent: Number) -> None:
        if abs(exponent) > self.config.max_exponent:
            raise ToolError(f"exponent {exponent} is too large; the limit is {self.config.max_exponent}")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
            # Estimate the result size before computing it: |base| ** exponent has about this many bits.
            bits = (abs(base).bit_length() - 1) * exponent if abs(base) > 1 else 0
            if bits > self.config.max_int_bits:
                raise ToolError(f"{base}**{exponent} is too large; results are limited to "
                                f"{self.config.max_int_bits} bits")

    def _checked(self, value: Any) -> Number:
        if isinstance(value, int) and value.bit_length() > self.config.max_int_bits:
            raise ToolError(f"result is too large; integers are limited to {self.config.max_int_bits} bits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError(f"result is not a finite number ({value})")
        if isinstance(value, complex):
            raise ToolError("result is a complex number; only real results are supported")
        return value


def evaluate_expression(expression: str, config: CalculatorConfig | None = None) -> Number:
    """Evaluate an arithmetic expression safely; raise `ToolError` with a message for the model."""
    config = config or CalculatorConfig()
    if len(expression) > config.max_expression_chars:
        raise ToolError(f"expression has {len(expression)} characters; the limit is {config.max_expression_chars}")
    try:
        return _Evaluator(config).visit(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as err:
        raise ToolError(f"could not parse {expression!r}: {err.msg}") from err
    except ZeroDivisionError as err:
        raise ToolError("division by zero") from err
    except OverflowError as err:
        raise ToolError("numeric overflow: a step's result is too large for a float") from err
    except ValueError as err:  # math domain errors, e.g. sqrt(-1); ToolError is a ValueError too
        if isinstance(err, ToolError):
            raise
        raise ToolError(f"math error: {err}") from err
    except RecursionError as err:
        raise ToolError("expression is nested too deeply") from err


def format_number(value: Number, significant_digits: int) -> str:
    """Ints exactly; floats with `significant_digits` significant digits (`2.0` -> `2`)."""
    return str(value) if isinstance(value, int) else format(value, f".{significant_digits}g")


class CalculatorTool(BaseTool):
    """Evaluates an arithmetic expression; the response is the number as text."""

    def __init__(self, config: dict[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.config: CalculatorConfig = build_tool_config(CalculatorConfig, config, self.name)

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`calculator(expression: string)`."""
        return OpenAIFunctionToolSchema.with_string_argument(
            "calculator",
            "Evaluate an arithmetic expression, e.g. '(3 + 4) * 2 ** 3 / sqrt(16)'. Supports + - * / // % **, "
            "parentheses, pi, e and sqrt, abs, round, floor, ceil, exp, log, log10, sin, cos, tan, min, max.",
            "expression", "The arithmetic expression to evaluate.",
        )

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Evaluate `parameters["expression"]`; the last result is kept in `instance.state["result"]`."""
        value = await asyncio.to_thread(evaluate_expression, parameters["expression"], self.config)
        instance.state["result"] = value
        return ToolResponse(text=format_number(value, self.config.significant_digits)), 0.0, {}
