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
