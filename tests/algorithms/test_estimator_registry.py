"""The estimator registry's specs: what each built-in needs, custom estimators, and no name branches elsewhere."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

from hybridflow.algorithms.estimator_registry import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    EstimatorSpec,
    estimator_spec,
    register_adv_est,
)

PACKAGE = Path(__file__).resolve().parents[2] / "hybridflow"

# `== "<estimator>"` branches that remain in the trainer's runtime files until they read the spec (issue 28 item 5,
# the trainer side): (path relative to hybridflow/, estimator name). Remove an entry when its branch goes.
KNOWN_BRANCHES: set[tuple[str, str]] = set()


def test_built_in_specs_say_what_each_estimator_needs():
    assert estimator_spec("gae") == EstimatorSpec(needs_critic=True)
    assert estimator_spec(AdvantageEstimator.REMAX) == EstimatorSpec(greedy_baseline=True)
    assert estimator_spec("prime") == EstimatorSpec(group_based=True, implicit_prm=True)
    assert estimator_spec("reinforce_plus_plus") == EstimatorSpec()
    group = {name for name in ADV_ESTIMATORS.names() if estimator_spec(name).group_based}
    assert group == {"grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg", "prime",
                     "optimal_token_baseline", "tir_optimal_token_baseline"}
    assert [name for name in ADV_ESTIMATORS.names() if estimator_spec(name).needs_critic] == ["gae"]
    assert [name for name in ADV_ESTIMATORS.names() if not estimator_spec(name).runs_with_one_sample] == ["grpo_passk"]
    reads_energy = {name for name in ADV_ESTIMATORS.names() if estimator_spec(name).needs_sum_pi_squared}
    assert reads_energy == {"optimal_token_baseline", "tir_optimal_token_baseline"}


def test_every_built_in_name_resolves_to_its_function():
    for member in AdvantageEstimator:
        fn = ADV_ESTIMATORS.get(member.value)
        assert callable(fn) and fn.__name__.startswith("compute_")


def test_custom_estimator_declares_its_needs_or_needs_nothing():
    plain, grouped = f"plain_{uuid.uuid4().hex[:6]}", f"grouped_{uuid.uuid4().hex[:6]}"
    register_adv_est(plain)(lambda **_: None)
    register_adv_est(grouped, EstimatorSpec(group_based=True))(lambda **_: None)
    assert estimator_spec(plain) == EstimatorSpec()
    assert estimator_spec(grouped).group_based
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est(grouped, EstimatorSpec(needs_critic=True))(lambda **_: None)
    assert not estimator_spec(grouped).needs_critic  # a refused registration changes no spec
    with pytest.raises(KeyError, match="grpo"):
        estimator_spec("grpo_typo")


def _estimator_branches(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each `x == "<name>"` / `x != "<name>"` / `x in ("<name>", ...)` whose other side mentions an
    estimator (`adv_estimator`, `estimator`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = []
        for operand in operands:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            constants += [item.value for item in items if isinstance(item, ast.Constant) and item.value in names]
        if constants and "estimator" in ast.unparse(node).replace(repr(constants[0]), ""):
            found += [(node.lineno, name) for name in constants]
    return found


def test_no_estimator_name_branch_outside_the_registry():
    names = set(ADV_ESTIMATORS.names())
    branches = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("algorithms/"):
            continue  # the registry, its spec and the estimators themselves
        for line, name in _estimator_branches(ast.parse(path.read_text(), str(path)), names):
            branches.add((relative, name, line))
    unexpected = sorted(b for b in branches if (b[0], b[1]) not in KNOWN_BRANCHES)
    assert not unexpected, f"branches on an estimator's name; read estimator_spec(name) instead: {unexpected}"


def test_the_branch_finder_finds_a_branch():
    tree = ast.parse('if cfg.algorithm.adv_estimator == "gae":\n    pass\nif mode in ("grpo", "x"):\n    pass\n')
    assert _estimator_branches(tree, {"gae", "grpo"}) == [(1, "gae")]
