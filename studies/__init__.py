"""Studies: experiments that train and compare models (loss remedies, convergence against batch size), on the
benchmarks' harness, with their records in bench/results/."""
