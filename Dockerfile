# The one image every compose.yaml service runs.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN PYTHON=python3 scripts/setup && ln -s /app/.venv/bin/neuron-bus /usr/local/bin/neuron-bus
EXPOSE 4222 6222 8222 8080 9100
