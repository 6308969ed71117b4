"""Primitive coverage as a tested contract: every primitive the installed jax defines is classified by
``autoshard.strategies.coverage()`` as a rule, as structure, or as replicated with the reason why."""

import pytest

from autoshard.strategies import coverage, installed_primitives

# The primitives that issue 14 names: each must have a real rule.
MUST_HAVE_RULES = (
    "stack unstack tile bitcast_convert_type random_clone random_bits random_wrap random_unwrap random_split "
    "random_fold_in random_seed threefry2x32 reshard ragged_dot_general approx_top_k top_k shard_map "
    "custom_partitioning exp2 tan logistic erf_inv polygamma zeta bessel_i0e bessel_i1e igamma_grad_a "
    "regularized_incomplete_beta nextafter cbrt clz population_count conj real imag complex reduce_precision "
    "copy reduce_xor reduce_and argmax cumsum select_and_scatter_add reduce_window sort clamp squeeze rev split "
    "convert_element_type iota dot_general conv_general_dilated gather scatter-add"
).split()
STRUCTURAL = ("jit", "custom_jvp_call", "custom_vjp_call", "remat2", "closed_call", "scan")
KERNEL_LANGUAGE = "replicated: a kernel-language primitive"


@pytest.fixture(scope="module")
def installed():
    return installed_primitives()


@pytest.fixture(scope="module")
def classified():
    return coverage()


def test_every_primitive_of_the_installed_jax_is_classified(installed, classified):
    missing = sorted(set(installed) - set(classified))
    assert not missing, "unclassified primitives (register a rule or register_replicated(..., why=...)): " + ", ".join(
        f"{n} ({', '.join(sorted(installed[n]))})" for n in missing)
    for name in installed:
        c = classified[name]
        assert c in ("rule", "structural") or (c.startswith("replicated: ") and len(c) > len("replicated: ") + 10), (
            name, c)


def test_rules_and_structure_cover_at_least_60_percent(installed, classified):
    """Counted over the primitives a traced step can contain; kernel-language primitives (Pallas,
    Mosaic) exist only inside a kernel body, so they are classified but not counted."""
    planned = [n for n in installed if not classified[n].startswith(KERNEL_LANGUAGE)]
    covered = [n for n in planned if classified[n] in ("rule", "structural")]
    all_covered = [n for n in installed if classified[n] in ("rule", "structural")]
    print(f"coverage: {len(covered)}/{len(planned)} = {len(covered) / len(planned):.1%} of the primitives a step can "
          f"contain have a rule or are structure ({len(all_covered)}/{len(installed)} = "
          f"{len(all_covered) / len(installed):.1%} of all {len(installed)}, kernel languages included)")
    assert len(covered) >= 0.6 * len(planned)


@pytest.mark.parametrize("name", MUST_HAVE_RULES)
def test_named_primitives_have_rules(classified, name):
    assert classified.get(name) == "rule", (name, classified.get(name))


@pytest.mark.parametrize("name", STRUCTURAL)
def test_call_primitives_are_structure(classified, name):
    assert classified.get(name) == "structural"


def test_replicated_reasons_are_specific(classified):
    assert classified["pure_callback"].startswith("replicated: a host callback")
    assert classified["psum"].startswith("replicated: a collective over manual mesh axes")
    assert classified["while"].startswith("replicated: ")


def test_op_info_holds_what_each_pass_asks_of_a_primitive():
    from autoshard.strategies import op_info

    dot, conv = op_info("dot_general"), op_info("conv_general_dilated")
    assert dot.contraction and conv.contraction and dot.rule is not None and not dot.follows
    assert op_info("exp").follows and op_info("exp").expensive and op_info("exp").fusible
    assert op_info("broadcast_in_dim").fused_source and op_info("broadcast_in_dim").weak_layout
    assert op_info("reduce_sum").reduction and op_info("reshape").bitcast and op_info("reduce_window_max").windowed
    assert op_info("scan").structure == "scan" and op_info("pjit").structure == "inlined"
    assert not op_info("while").duplicable and not op_info("io_callback").duplicable
    assert op_info("no_such_primitive").rule is None  # the default entry: no rule, nothing special


def test_register_op_sets_properties_and_rejects_unknown_ones():
    from autoshard.strategies import op_info, register_op

    register_op("autoshard_test_prim", expensive=True)
    register_op("autoshard_test_prim", bitcast=True)  # properties accumulate
    info = op_info("autoshard_test_prim")
    assert info.expensive and info.bitcast and info.rule is None
    with pytest.raises(TypeError, match="not OpInfo properties.*Fix:"):
        register_op("autoshard_test_prim", fusable=True)
    with pytest.raises(ValueError, match="structure='loop'.*Fix:"):
        register_op("autoshard_test_prim", structure="loop")
    assert "autoshard_test_prim" not in coverage()  # properties alone are no rule


def test_convolution_flops_count_the_kernel_window_once():
    """2 * output elements * (input features per group * window), whatever the kernel layout (HWIO here)."""
    import jax
    import jax.numpy as jnp

    from autoshard.capture import capture_graph
    from autoshard.strategies import op_flops

    x = jax.ShapeDtypeStruct((2, 8, 8, 6), jnp.float32)  # NHWC
    w = jax.ShapeDtypeStruct((3, 3, 3, 4), jnp.float32)  # HWIO, two feature groups of 3 inputs

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=2)

    program = capture_graph(conv, (x, w))
    (op,) = program.graph.ops
    assert op_flops(op, program.avals) == 2.0 * (2 * 8 * 8 * 4) * (3 * 3 * 3)
