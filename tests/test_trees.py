"""shardtensor.trees: the one map over nested values (batches, op arguments, model outputs)."""

import collections
import dataclasses

import torch

from shardtensor.trees import leaves, map_leaves, mapping_with, tensors_in


class Batch(collections.UserDict):
    """Like transformers' BatchEncoding: a UserDict with an extra attribute, unknown to torch's pytree."""

    def __init__(self, data=None, note="kept"):
        super().__init__(data)
        self.note = note


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    label: str = "x"


Pair = collections.namedtuple("Pair", "first second")


def test_containers_keep_their_types_and_extras():
    t = torch.ones(2)
    tree = {
        "a": [t, (t, "text")],
        "b": Pair(t, 3),
        "c": collections.OrderedDict(k=t),
        "d": Batch({"ids": t}, note="mine"),
        "e": Frozen(t),
        "f": collections.defaultdict(list, k=[t]),
        "g": torch.Size([2, 3]),
    }
    out = map_leaves(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)
    assert out["a"][0].tolist() == [2, 2] and out["a"][1][1] == "text" and type(out["a"][1]) is tuple
    assert type(out["b"]) is Pair and out["b"].first.tolist() == [2, 2] and out["b"].second == 3
    assert type(out["c"]) is collections.OrderedDict and out["c"]["k"].tolist() == [2, 2]
    assert type(out["d"]) is Batch and out["d"].note == "mine" and out["d"]["ids"].tolist() == [2, 2]
    assert type(out["e"]) is Frozen and out["e"].x.tolist() == [2, 2] and out["e"].label == "x"
    assert type(out["f"]) is collections.defaultdict and out["f"]["k"][0].tolist() == [2, 2]
    assert out["g"] == torch.Size([2, 3])
    assert tree["d"]["ids"] is t and tree["e"].x is t  # the input is not changed


def test_leaves_in_order_and_tensors_only():
    a, b = torch.zeros(1), torch.ones(1)
    tree = (a, {"k": [1, Batch({"z": b})]}, None)
    assert leaves(tree)[0] is a and leaves(tree)[1:3] == [1, b] and leaves(tree)[3] is None
    assert [t is x for t, x in zip(tensors_in(tree), (a, b))] == [True, True]


def test_inside_an_opened_container_torch_containers_are_mapped_too():
    t = torch.ones(1)
    out = map_leaves(lambda v: "T" if isinstance(v, torch.Tensor) else v, Batch({"h": (t, [t]), "n": 1}))
    assert out.data == {"h": ("T", ["T"]), "n": 1}


def test_mapping_with_falls_back_to_a_dict():
    class Stubborn(collections.abc.Mapping):
        def __init__(self, d):
            self.d = d

        def __getitem__(self, k):
            return self.d[k]

        def __iter__(self):
            return iter(self.d)

        def __len__(self):
            return len(self.d)

    assert mapping_with(Stubborn({"a": 1}), {"a": 2}) == {"a": 2}
    assert map_leaves(lambda v: v + 1, Stubborn({"a": 1})) == {"a": 2}
