"""Emulated wide-area links on one machine: the link emulator (linkem), the star and regional
topologies built on LocalSwarm (topologies), and the emulator's own cost measured over NATS (probe).
"""
