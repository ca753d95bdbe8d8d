import json

import pytest

from psrl.environments.dataset import DatasetError, load_rows, row_to_task, write_rows

pytestmark = pytest.mark.timeout(30)

ROWS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        "data_source": "toy",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0},
        "agent_name": "multi_turn_agent",
    },
    {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": "toy", "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 1}},
]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_round_trip_and_task(tmp_path, suffix):
    path = write_rows(tmp_path / f"rows{suffix}", ROWS)
    rows = load_rows(path)
    assert len(rows) == 2
    task = row_to_task(rows[0])
    assert task.prompt[1] == {"role": "user", "content": "1+1?"}
    assert task.ground_truth == "2" and task.data_source == "toy" and task.extra_info["index"] == 0
    assert rows[0]["agent_name"] == "multi_turn_agent"
    assert load_rows([path, path], max_rows=3)[2]["extra_info"]["index"] == 0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"data_source": "x"}, "column 'prompt'"),
        ({"prompt": [{"role": "user"}]}, r"prompt\[0\]"),
        ({"prompt": "q", "reward_model": "4"}, "'reward_model' must be a mapping"),
        ({"prompt": "q", "extra_info": [1]}, "'extra_info' must be a mapping"),
        ({"prompt": "q", "env_class": 3}, "'env_class' must be a registered name"),
    ],
)
def test_bad_rows_name_file_row_and_column(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[1]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=message) as err:
        load_rows(path)
    assert f"{path} row 1" in str(err.value)


def test_mixed_types_cannot_be_parquet(tmp_path):
    with pytest.raises(DatasetError, match="write .jsonl instead"):
        write_rows(tmp_path / "mixed.parquet", [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}])
    assert len(load_rows(write_rows(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}]))) == 2


def test_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown data file type"):
        load_rows(tmp_path / "x.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "q"}\n{oops\n')
    with pytest.raises(DatasetError, match="broken.jsonl:2: not valid JSON"):
        load_rows(tmp_path / "broken.jsonl")
    with pytest.raises(DatasetError, match="no data files"):
        load_rows([])
