"""`SessionTree`: a full prompt → the shortest SGLang session request that rebuilds it on the server."""

from __future__ import annotations

from relax_pipeline.engine.sglang.sessions import SessionTree

BOS = 1


def tree_with(*nodes: tuple[str, list[int]]) -> SessionTree:
    tree = SessionTree("s", BOS)
    for rid, tokens in nodes:
        tree.finished(tree.wire_rid(rid), tokens, [])
    return tree


def test_a_first_turn_is_a_root_with_the_whole_prompt() -> None:
    request = SessionTree("s", BOS).request([1, 5, 6])
    assert (request.input_ids, request.params, request.kept) == ([1, 5, 6], {"id": "s"}, 0)


def test_a_next_turn_sends_only_its_new_tokens_after_the_node_it_extends() -> None:
    tree = tree_with(("t1", [1, 5, 6, 7]), ("other", [1, 5, 9]))
    request = tree.request([1, 5, 6, 7, 8, 9])
    assert (request.input_ids, request.params, request.kept) == ([8, 9], {"id": "s", "rid": "t1"}, 4)


def test_a_fork_splices_at_the_shared_length() -> None:
    tree = tree_with(("t1", [1, 5, 6, 7]))
    request = tree.request([1, 5, 2, 3])
    assert (request.input_ids, request.params, request.kept) == ([2, 3], {"id": "s", "rid": "t1", "offset": 2}, 2)


def test_the_delta_is_never_empty_nor_starts_with_bos() -> None:
    tree = tree_with(("t1", [1, 5, 6, 7]))
    assert tree.request([1, 5, 6, 7]).params == {"id": "s", "rid": "t1", "offset": 3}, "a resume with nothing new"
    assert tree.request([1, 5, 6, 7]).input_ids == [7]
    bos_next = tree.request([1, 5, 6, 7, BOS, 4])
    assert (bos_next.input_ids, bos_next.params["offset"]) == ([7, BOS, 4], 3), "SGLang would drop a leading BOS"
    assert tree.request([2, 3]).params == {"id": "s"}, "nothing shared: a root"


def test_a_resumed_rid_gets_a_new_wire_rid_and_forget_starts_over() -> None:
    tree = tree_with(("t1", [1, 5, 6]))
    assert tree.wire_rid("t1") == "t1~1" and tree.wire_rid("t1") == "t1~2" and tree.wire_rid("t2") == "t2"
    tree.forget()
    assert tree.request([1, 5, 6, 7]).params == {"id": "s"}
