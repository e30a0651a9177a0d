"""The learned policy: a graph network over the partitioning IR (`networks`), actors that play
it (`actors`), the Reverb data plane between actors and learners (`reverb_adders`,
`variable_client`) and builders that wire an agent together (`builders`)."""
