from neuron_bus.cli import main

main()
