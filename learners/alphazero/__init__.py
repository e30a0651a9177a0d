"""AlphaZero's learning side: its learner settings (`config`), the pure loss (`losses`) and the
builder that wires actor, adder, replay and learner (`builder`). The acting side is
`agents.alphazero`."""
