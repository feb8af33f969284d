"""Synthetic tasks: tokenizer round trip, deterministic problem streams, exact rewards."""

import json

import pytest
from tokenizers import Tokenizer

from lockstep.rollout.tasks import Problem, Task, TaskConfig, build_tokenizer


def test_tokenizer_ids_and_round_trip(tmp_path):
    tok = build_tokenizer()
    assert tok.get_vocab_size() == 16
    enc = tok.encode("<bos>07+45=52<eos>", add_special_tokens=False)
    assert enc.tokens == ["<bos>", "0", "7", "+", "4", "5", "=", "5", "2", "<eos>"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    # Saved in the tokenizers JSON format and loaded back unchanged (what other engines read).
    tok.save(str(tmp_path / "tokenizer.json"))
    json.loads((tmp_path / "tokenizer.json").read_text())
    back = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert back.encode("<bos>07+45=", add_special_tokens=False).ids == enc.ids[:7]
    assert back.decode([10, 11, 2], skip_special_tokens=False) == "78<eos>"


def test_addition_problem_and_reward():
    task = Task(TaskConfig(name="addition", digits=2))
    p = Problem("07+45=", "52")
    assert task.prompt_ids(p) == [1, 3, 10, 13, 7, 8, 14]
    ans = task.answer_ids(p)
    assert task.decode(ans) == "52"
    assert task.reward(p, ans) == 1.0
    assert task.reward(p, ans[:-1]) == 0.0            # no <eos>: truncated, not exact
    assert task.reward(p, ans + [task.eos_id]) == 0.0  # anything after <eos> is wrong
    assert task.reward(p, task.answer_ids(Problem("", "53"))) == 0.0
    assert task.prompt_len == 7 and task.max_new_tokens == 5


def test_addition_answers_are_sums():
    task = Task(TaskConfig(name="addition", digits=2))
    for p in task.problems(seed=3, start=0, count=200):
        a, b = p.prompt[:-1].split("+")
        assert len(a) == len(b) == 2 and int(p.answer) == int(a) + int(b)
        assert p.answer == str(int(p.answer))  # no leading zeros


def test_sort_task():
    task = Task(TaskConfig(name="sort", sort_length=5))
    for p in task.problems(seed=0, start=0, count=50):
        assert p.prompt.endswith(">") and len(p.prompt) == 6
        assert p.answer == "".join(sorted(p.prompt[:-1]))
        assert task.reward(p, task.answer_ids(p)) == 1.0
    assert task.max_new_tokens == 7


def test_problem_stream_is_a_pure_function_of_seed_and_index():
    task = Task(TaskConfig())
    full = task.problems(seed=7, start=0, count=40)
    assert task.problems(seed=7, start=25, count=15) == full[25:]  # resume from a cursor
    assert task.problems(seed=8, start=0, count=40) != full
    assert len({p.prompt for p in full}) > 30


def test_demonstrations_are_correct():
    task = Task(TaskConfig())
    demos = task.demonstrations(seed=1, start=0, count=20)
    for (prompt, answer), p in zip(demos, task.problems(1, 0, 20)):
        assert prompt == task.prompt_ids(p) and task.reward(p, answer) == 1.0


def test_bad_config_and_text_raise():
    with pytest.raises(ValueError, match="task.name"):
        TaskConfig(name="divide")  # multiply became a task (the agent toy)
    with pytest.raises(ValueError, match="task.digits"):
        TaskConfig(digits=0)
    task = Task(TaskConfig())
    with pytest.raises(ValueError, match="not among the task characters"):
        task.prompt_ids(Problem("ab", "1"))
    with pytest.raises(ValueError, match="index must be >= 0"):
        task.problem(0, -1)
