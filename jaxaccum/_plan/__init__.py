"""The planners: AOT memory analysis and the compiled HLO choose N (and the
sharded modes) for a budget."""
