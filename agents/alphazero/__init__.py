"""AlphaZero's acting side: its actor settings (`config`), the prior and value search reads
from the graph network (`networks`), the searching actor (`acting`) and the demonstrations it
may replay (`demonstrations`). The learning side is `learners.alphazero`."""
