"""One compiled program per fragment layout (#32): the fragments of equal layout run the same program
with their rows' starts as an argument, and it computes what the per-fragment program computes, bit
for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.outer import codecs
from diloco.outer.fragments import make_fragments
from diloco.outer.sync import OuterSync, outer_optimizer


def stacked_params(L=6, seed=0):
    """A tree like nn.scan's: blocks stacked on a leading layer axis, the embedding outside."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"blocks": {"mlp": jax.random.normal(k[0], (L, 4, 3)), "norm": jax.random.normal(k[1], (L, 4))},
            "embed": jax.random.normal(k[2], (10, 4))}


@pytest.mark.parametrize("pattern,lpf,embed,groups", [
    ("strided", 2, "first", ((0,), (1, 2))),
    ("sequential", 2, "first", ((0,), (1, 2))),
    ("strided", 1, "own", ((0, 1, 2, 3, 4, 5), (6,))),
    ("sequential", 3, "last", ((0,), (1,))),
])
def test_fragments_of_one_layout_are_grouped(pattern, lpf, embed, groups):
    fr = make_fragments(stacked_params(), 6, lpf, 0, pattern, embed)
    assert fr.groups() == groups


def test_rows_not_in_progression_get_their_own_layout():
    # 7 layers, 3 fragments sequential: fragment rows (0,1,2), (3,4), (5,6): progressions of other counts
    fr = make_fragments(stacked_params(L=7), 7, 0, 3, "sequential", "first")
    assert [len(fr.parts[p][0][1]) for p in range(3)] == [3, 2, 2]
    assert fr.groups() == ((0,), (1, 2))
    assert fr.layout(1) == fr.layout(2) != fr.layout(0)


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("codec", ["none", "e3m0"])
def test_shared_program_equals_the_per_fragment_one_bit_for_bit(pattern, codec):
    R, L = 2, 6
    params = stacked_params(L)
    fr = make_fragments(params, L, 2, 0, pattern, "first")
    sync = OuterSync(fr, codecs.make_codec(codec, block_size=4), outer_optimizer(0.7, 0.9), alpha=0.25)
    outer = sync.init(params)
    noise = jax.tree_util.tree_map(lambda x: 0.01 * jnp.sin(jnp.arange(R * x.size, dtype=jnp.float32)
                                                            ).reshape((R,) + x.shape), params)
    params_R = jax.tree_util.tree_map(lambda x, n: x[None] + n, params, noise)
    key, contrib, mask = jax.random.PRNGKey(3), jnp.ones(R), jnp.array([True, False])
    rep = fr.groups()[1][0]  # the program is traced for the group's first fragment, then reused

    @jax.jit
    def shared(params_R, g_params, opt_p, starts):
        avg = sync.average(sync.delta(params_R, outer.replace(params=g_params), rep, starts), key, contrib, rep)
        g2, opt2 = sync.outer_step(g_params, opt_p, avg, rep, starts)
        merged = sync.merge(params_R, outer.replace(params=g2), rep, mask, starts)
        return avg, g2, opt2, merged

    for p in fr.groups()[1]:
        assert fr.starts(p).tolist() != fr.starts(rep).tolist() or p == rep
        avg, g2, opt2, merged = shared(params_R, outer.params, outer.opt[p], jnp.asarray(fr.starts(p)))
        ref = sync.send(params_R, outer, p, key, contrib)
        ref = sync.update(ref, p)
        ref_merged = sync.merge(params_R, ref, p, mask)
        for a, b in zip(jax.tree_util.tree_leaves(avg), jax.tree_util.tree_leaves(ref.pending[p])):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree_util.tree_leaves((g2, opt2, merged)),
                        jax.tree_util.tree_leaves((ref.params, ref.opt[p], ref_merged))):
            np.testing.assert_array_equal(a, b)
        # fragment p moved and nothing else did: the other fragments' rows are θᵍ's
        for q in range(fr.P):
            if q != p:
                np.testing.assert_array_equal(fr.flatten(g2, q), fr.flatten(outer.params, q))
    assert shared._cache_size() == 1  # one compile for the whole group


def test_diloco_fragments_says_which_fragments_share_a_program(capsys, shared_dir):
    """1B Streaming (24 blocks under nn.scan, 3 per fragment, strided, embeddings with fragment 0): 8
    fragments, 2 programs per kind — fragment 0 and fragments 1…7."""
    from diloco.fragments_cli import main

    spm = shared_dir / "data" / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model"
    assert main(["--config", "experiments/c4_scaling.py:1B,streaming_ovl_fp4_h100",
                 f"--config.vocab=sentencepiece:{spm}", "--config.data=stdlib"]) == 0
    out = capsys.readouterr().out
    assert "compiled programs: one per fragment layout, 2 for 8 fragments\n" in out
    assert out.endswith("    fragment 0\n    fragments 1, 2, 3, 4, 5, 6, 7\n")
