import pytest

from psrl.environments import REWARD_FUNCTIONS
from psrl.environments.mathexpr import equivalent
from psrl.environments.rewards import last_boxed, math_reward

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("solution", "truth", "reward"),
    [
        ("so the answer is \\boxed{42}.", 42, 1.0),
        ("\\boxed{41} no wait \\boxed{42}", "42", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", 1.0),
        ("\\boxed{2x+1}", "1+2*x", 1.0),  # simple symbolic equivalence
        ("\\boxed{\\pi r^2}", "r^2\\pi", 1.0),
        ("\\boxed{\\text{7}}", "7", 1.0),
        ("\\boxed{x^2}", "x^3", 0.0),
        ("\\boxed{3}", 4, 0.0),
        ("the answer is 42", 42, 0.0),  # no box, no reward
        ("\\boxed{42", 42, 0.0),  # unbalanced
        ("\\boxed{7}", ["6", "7"], 1.0),  # any of several accepted answers
    ],
)
def test_math_reward(solution, truth, reward):
    assert math_reward(solution, truth) == reward


def test_nested_braces_in_box():
    assert last_boxed("\\boxed{\\frac{a}{b}} tail") == "\\frac{a}{b}"


@pytest.mark.parametrize("hostile", ["__import__('os').system('x')", "9**9**9**9", "()" * 500, "x" * 10_000, "a.b", "1/0"])
def test_untrusted_answers_are_parsed_not_evaluated(hostile):
    # Nothing here may run code, hang or raise: it is simply not equal.
    assert math_reward(f"\\boxed{{{hostile}}}", "1") == 0.0
    assert equivalent(hostile, "1") is False


def test_registered_by_name():
    assert REWARD_FUNCTIONS.get("math") is math_reward


@pytest.mark.parametrize(
    ("solution", "truth", "reward"),
    [
        ("the tool printed 64433, so \\boxed{64433}", "64433", 1.0),
        ("\\boxed{64,433}", "64433", 1.0),
        ("\\boxed{x = -3.5}", "-3.5", 1.0),
        ("\\boxed{64434}", "64433", 0.0),
        ("\\boxed{811 * 80 - 447}", "64433", 0.0),  # the question's own expression: not computed
        ("\\boxed{811 \\times 80 - 447}", "64433", 0.0),
        ("\\boxed{2^{10}}", "1024", 0.0),
        ("64433", "64433", 0.0),  # no box
    ],
)
def test_math_number_wants_the_computed_number(solution, truth, reward):
    from psrl.environments.rewards import math_number_reward

    assert math_number_reward(solution, truth) == reward
    assert REWARD_FUNCTIONS.get("math_number") is math_number_reward


def test_math_accepts_the_unevaluated_expression_math_number_does_not():
    # Why ReTool's recipe uses math_number: with `math`, boxing "811 * 80 - 447" scored 1.0 in a
    # sampled RL batch from the SFT model, a reward for not calling the tool.
    assert math_reward("\\boxed{811 * 80 - 447}", "64433") == 1.0
