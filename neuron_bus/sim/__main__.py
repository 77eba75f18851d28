from neuron_bus.sim.run import main

main()
