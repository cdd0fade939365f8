"""map_datasets: one function over a dataset or over each dataset of a dict of them (eval_dataset's forms)."""

from posttrain.trainers.base import map_datasets


def test_map_datasets_over_one_a_dict_or_none():
    assert map_datasets(len, [1, 2, 3]) == 3
    assert map_datasets(len, {"a": [1], "b": [1, 2]}) == {"a": 1, "b": 2}
    assert map_datasets(len, None) is None


def test_map_datasets_names_each_dataset_when_asked():
    named = lambda data, name: (name, len(data))  # noqa: E731
    assert map_datasets(named, [1], name="eval") == ("eval", 1)
    assert map_datasets(named, {"x": [1, 2]}, name="eval") == {"x": ("eval[x]", 2)}
