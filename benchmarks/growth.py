"""Growing the batch: when does it pay, and what does the masked step cost?

Three experiments, one a mode (each writes its results under
benchmarks/results/; every run is a jitted `lax.while_loop`, one compile per
program, no host round trip per step):

``python benchmarks/growth.py [equivalence]`` (growth_equivalence.py, under a
minute on 2 cores; growth.json, growth.png): Smith et al.'s equivalence, a
`jaxaccum.growth.BatchRamp` doubling the batch where a step schedule would
halve the learning rate; and what a skipped micro-batch of the masked step
costs.

``python benchmarks/growth.py cost`` (growth_cost.py, about 8 minutes;
growth_cost.json, growth_cost.png): time to a held-out loss for the
noise-scale controller (`jaxaccum.growth.NoiseScaleBatch`) given each step
cost, against every fixed window and a Seesaw ramp, on an MLP classifier and
a character language model (growth_tasks.py).

``python benchmarks/growth.py adam-noise`` (growth_adam_noise.py, about 4
minutes; growth_adam_noise.json): why the controller misses at c=64 on the
MLP: the noise scale of Adam's preconditioned gradient against the raw one.
"""

import argparse
import importlib

# mode -> the module whose main() runs it; imported only when chosen.
MODES = {
    "equivalence": "growth_equivalence",
    "cost": "growth_cost",
    "adam-noise": "growth_adam_noise",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "mode",
        nargs="?",
        default="equivalence",
        choices=MODES,
        help="the experiment to run (default: %(default)s)",
    )
    args = parser.parse_args()
    importlib.import_module(MODES[args.mode]).main()


if __name__ == "__main__":
    main()
