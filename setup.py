from setuptools import find_packages, setup

setup(
    name="autoshard",
    version="0.1.0",
    description="Automatic sharding of JAX train steps: intra-operator planning with an ILP, lowered to jax.jit",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["autoshard", "autoshard.*", "benchmarks", "benchmarks.*"]),
    # the performance model's calibration files, measured on a chip (autoshard/perf/calibration/README.md)
    package_data={"autoshard.perf": ["calibration/*.json", "calibration/*.md"]},
    python_requires=">=3.10",
    # Tested with jax 0.10.2 (CPU) here; 0.11.x is what GPU images ship, so the range includes it.
    install_requires=[
        "jax>=0.10.0,<0.12",
        "jaxlib>=0.10.0,<0.12",
        "numpy>=1.24",
        "scipy>=1.11",
        # the strategy solver's cost function network engine (autoshard/solver/cfn.py); wheels exist for
        # Linux and macOS, and without it the solver runs its other searches
        'pytoulbar2>=1.4; platform_system != "Windows"',
    ],
    extras_require={
        "models": ["flax>=0.11", "optax>=0.2.4"],
        "test": [
            "flax>=0.11",
            "optax>=0.2.4",
            "equinox>=0.11",  # tests/test_equinox.py: eqx.Module steps under parallelize
            "pytest>=8",
            "pytest-xdist>=3.5",  # the default suite runs on every core (pyproject addopts)
            "hypothesis>=6.100",
            "nbclient>=0.10",
            "nbformat>=5.9",
            "ipykernel>=6",
            "matplotlib>=3.8",
            "rich>=13",
            "tqdm",
            "orbax-checkpoint>=0.11",
            "einops>=0.7",  # tests/zoo: GQA and ViT written as their communities write them
        ],
        "notebook": [
            "flax>=0.11",
            "optax>=0.2.4",
            "jupyter",
            "nbclient>=0.10",
            "nbformat>=5.9",
            "ipykernel>=6",
            "matplotlib>=3.8",
            "rich>=13",
            "tqdm",
        ],
    },
)
