"""TierVictims on its own, with no learned densities (engram/eviction.py; the model is tested in
tests/test_eviction_model.py): least recently used first, unreferenced blocks before those a session holds,
pinned/leased/moving blocks skipped but kept in their place, leaf-only mode for the tier that deletes, one
clock across tiers, and candidate arrays that stay O(blocks)."""

from __future__ import annotations

from collections.abc import Callable

from engram.eviction import TierVictims, tick
from engram.index import BlockMeta
from engram.layout import DType

TIER = "dram"


def block(name: str, *, tier: str = TIER, parent: str = "") -> BlockMeta:
    return BlockMeta(key=name.encode(), parent=parent.encode(), namespace="ns", model_fingerprint=b"fp",
                     tokens=b"", num_tokens=16, dtype=DType.BF16, shape=(1, 2, 16, 1, 1), nbytes=64, checksum=0,
                     locations=[tier], full=True)


class Tier:
    """The blocks of one tier in the order they were used (oldest first), as the store would feed them."""

    def __init__(self, *names: str, tier: str = TIER) -> None:
        self.blocks: dict[bytes, BlockMeta] = {}
        self.lru = TierVictims(tier, self.blocks.get)
        for name in names:
            self.add(block(name, tier=tier))

    def add(self, meta: BlockMeta) -> BlockMeta:
        tick(meta)
        self.blocks[meta.key] = meta
        self.lru.add(meta)
        return meta

    def __getitem__(self, name: str) -> BlockMeta:
        return self.blocks[name.encode()]

    @property
    def lookup(self) -> Callable[[bytes], BlockMeta | None]:
        return self.blocks.get

    def use(self, name: str) -> None:
        """A read or a put hit: a new tick."""
        tick(self[name])

    def victim(self, *, leaf_only: bool = False) -> str | None:
        meta = self.lru.victim(leaf_only=leaf_only)
        return None if meta is None else meta.key.decode()

    def take(self) -> str | None:
        """One victim, which then leaves the tier (as the store deletes or demotes it)."""
        name = self.victim()
        if name is not None:
            del self.blocks[name.encode()]
        return name

    def evict_all(self, *, leaf_only: bool = False) -> list[str]:
        """Victims until none is left; each leaves the tier (and the index) as the store would delete it."""
        order = []
        while (name := self.victim(leaf_only=leaf_only)) is not None:
            order.append(name)
            meta = self.blocks.pop(name.encode())
            parent = self.blocks.get(meta.parent)
            if parent is not None:
                parent.children -= 1
                if parent.children == 0:
                    self.lru.leaf_again(parent)  # what the store does when the index reports a new leaf
        return order


def test_least_recently_used_goes_first() -> None:
    assert Tier("a", "b", "c").evict_all() == ["a", "b", "c"]


def test_a_use_moves_a_block_to_the_back() -> None:
    tier = Tier("a", "b", "c")
    tier.use("a")
    tier.use("b")
    assert tier.evict_all() == ["c", "a", "b"]


def test_blocks_a_session_references_go_after_every_unreferenced_one() -> None:
    tier = Tier("a", "b", "c", "d")
    for name in ("a", "c"):  # the two oldest of their class
        tier[name].refs = 1
    assert tier.evict_all() == ["b", "d", "a", "c"]


def test_dropping_the_last_reference_restores_the_block_to_its_true_recency() -> None:
    tier = Tier("a", "b", "c")
    tier["a"].refs = 1
    tier["a"].refs = 0  # unreferenced again, with the tick it had: the oldest
    assert tier.evict_all() == ["a", "b", "c"]


def test_blocks_several_sessions_hold_go_after_those_one_session_holds() -> None:
    # a and b: a prefix two live sessions share (the oldest blocks); c, d: one session's private tail.
    tier = Tier("a", "b", "c", "d", "e")
    for name, refs in (("a", 2), ("b", 3), ("c", 1), ("d", 1)):
        tier[name].refs = refs
    assert tier.evict_all() == ["e", "c", "d", "a", "b"]


def test_a_block_one_session_lets_go_of_returns_to_the_private_class() -> None:
    tier = Tier("a", "b")
    tier["a"].refs = 2
    tier["b"].refs = 1
    tier["a"].refs = 1  # one of its two sessions closed: a is private now, and the older of the two
    assert tier.evict_all() == ["a", "b"]


def test_referenced_blocks_are_still_victims_when_nothing_else_is_left() -> None:
    tier = Tier("a", "b")
    for name in ("a", "b"):
        tier[name].refs = 2
    assert tier.evict_all() == ["a", "b"]  # sessions cannot wedge a tier


def test_pinned_leased_and_moving_blocks_are_skipped_and_keep_their_place() -> None:
    tier = Tier("a", "b", "c", "d")
    tier["a"].pins = 1
    tier["b"].leases = 1
    tier["c"].moving = True
    assert tier.take() == "d"
    assert tier.take() is None  # every candidate left is held
    tier["a"].pins = tier["b"].leases = 0
    tier["c"].moving = False
    tier.add(block("e"))  # newer than all of them
    # Released without a new tick: they come back in their own order, before the newer block.
    assert [tier.take() for _ in range(4)] == ["a", "b", "c", "e"]


def test_leaf_only_takes_the_oldest_leaf_and_the_parent_once_its_last_child_goes() -> None:
    # root <- mid <- leaf, and an older lone block: plain LRU would take the chain's root first.
    tier = Tier("lone")
    tier.add(block("root"))
    tier.add(block("mid", parent="root"))
    tier.add(block("leaf", parent="mid"))
    tier["root"].children = tier["mid"].children = 1
    tier.use("lone")  # now the newest
    assert tier.evict_all(leaf_only=True) == ["leaf", "mid", "root", "lone"]


def test_without_leaf_only_inner_blocks_go_in_plain_lru_order() -> None:
    tier = Tier("root")
    tier.add(block("leaf", parent="root"))
    tier["root"].children = 1
    assert tier.victim() == "root"  # demotion keeps a block reachable: any block may go


def test_inner_blocks_are_candidates_again_as_soon_as_a_tier_leaves_leaf_only_mode() -> None:
    tier = Tier("root")
    tier.add(block("leaf", parent="root"))
    tier.add(block("other"))
    tier["root"].children = 1
    assert tier.victim(leaf_only=True) == "leaf"  # the inner root is passed over
    tier["leaf"].locations = ["nvme"]  # demoted, not deleted: root still has its child
    assert tier.victim() == "root"  # demotion may take any block, and nothing had to be rebuilt
    assert tier.victim(leaf_only=True) == "other"


def test_rebuild_takes_the_blocks_of_its_tier_only() -> None:
    tier = Tier()
    metas = [block("a"), block("b", tier="nvme"), block("c", parent="a")]
    for m in metas:
        tick(m)
        tier.blocks[m.key] = m
    metas[0].children = 1
    tier.lru.rebuild(metas)
    assert len(tier.lru) == 2
    assert tier.victim(leaf_only=True) == "c"
    assert tier.victim() == "a"


def test_stale_entries_are_skipped() -> None:
    tier = Tier("a", "b", "c")
    tier["a"].locations = ["nvme"]  # moved to another tier
    del tier.blocks[b"b"]  # left the index
    tier.use("c")  # its first entry is stale now; the fresh one counts
    assert tier.evict_all() == ["c"]


def test_one_clock_across_tiers_keeps_recency_when_a_block_moves() -> None:
    dram, nvme = Tier("old", "new"), Tier(tier="nvme")
    nvme.add(block("resident", tier="nvme"))  # in nvme for a while, but used after "old"
    moved = dram.blocks.pop(b"old")
    moved.locations = ["nvme"]
    nvme.blocks[moved.key] = moved
    nvme.lru.add(moved)  # a demotion: no new tick
    assert nvme.evict_all() == ["old", "resident"]


def test_candidate_arrays_stay_proportional_to_the_blocks() -> None:
    tier = Tier("keep")
    for i in range(5000):  # blocks that come and go without ever being a victim (deleted on request)
        meta = tier.add(block(f"b{i}"))
        del tier.blocks[meta.key]
    assert len(tier.lru) <= 2 * 1 + 1024 + 1  # compacted once stale entries pass twice the live ones plus 1024
    assert tier.victim() == "keep"


def test_a_large_tier_samples_its_candidates_and_still_takes_an_old_block() -> None:
    """Past 2 x SAMPLE candidates the search compares a random sample: never a held block, and an old one
    (the oldest of 16 draws out of 1,000 is among the oldest 60 on average)."""
    tier = Tier(*(f"b{i}" for i in range(1000)))
    tier["b3"].leases = 1
    picks = [tier.take() for _ in range(50)]
    assert "b3" not in picks
    ages = sorted(int(p[1:]) for p in picks if p is not None)
    assert len(ages) == 50 and ages[len(ages) // 2] < 200


def test_a_search_that_finds_only_held_blocks_in_its_sample_scans_for_the_evictable_one() -> None:
    tier = Tier(*(f"b{i}" for i in range(500)))
    for i in range(500):
        tier[f"b{i}"].leases = int(i != 321)
    found = tier.lru.victim(leaf_only=False)
    assert found is not None and found.key == b"b321"


def test_a_search_that_will_not_wait_gives_up_after_max_held_blocks() -> None:
    """A promotion (make_room(wait=False)) passes at most max_held leased blocks, then skips, instead of
    searching a tier that its reader's own leased chain fills, for every block it promotes. Below 2 x SAMPLE
    candidates the search compares them all (cheap), so the tier here is large."""
    tier = Tier(*(f"b{i}" for i in range(1000)))
    for i in range(1000):
        tier[f"b{i}"].leases = int(i != 500)  # all but one are being read
    assert tier.lru.victim(leaf_only=False, max_held=4) is None
    found = tier.lru.victim(leaf_only=False)  # a search that waits finds the one evictable block
    assert found is not None and found.key == b"b500"


def test_a_block_that_arrives_after_a_search_kept_candidates_is_ranked_with_them() -> None:
    """A search keeps its next best candidates for the next searches (while the model is cold). An unheld block
    put after it ranks ahead of held ones (no session holds it: it goes first), but the kept held candidates were
    taken without it: a session's block went while one nobody held stayed."""
    tier = Tier()
    for name in ("h1", "h2", "h3", "h4", "h5"):
        tier.add(block(name)).refs = 1  # each held by a live session
    assert tier.take() == "h1"  # the search keeps h2 and h3 for the next ones
    tier.add(block("u"))  # the newest block, held by no session
    assert tier.take() == "u"
    assert tier.take() == "h2"  # then the kept held ones, oldest first
