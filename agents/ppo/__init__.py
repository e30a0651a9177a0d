"""PPO's acting side: its actor settings (`config`), the sampling policy over the shared graph
network (`networks`) and the actor (`acting`). The learning side is `learners.ppo`."""
