"""The swarm simulator (scripts/swarm_sim): thousands of simulated nodes on a real bus.

- swarm.py    ground truth: ranges, speeds, latencies, churn and sessions, from a seed
- pool.py     the node pool process: reports, heartbeats and pongs for every simulated node
- probe.py    the clients: route and coverage requests, timed, and the route checks
- quality.py  decision quality: a route's true cost against the best route there is
- procs.py    the processes (nats-server, trackers, pool), their CPU and memory
- run.py      the run: phases, figures, JSON
"""
