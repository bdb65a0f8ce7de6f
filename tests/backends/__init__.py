"""Backend tests: one contract suite run against every backend, and each
backend's own behaviour (SQL, Redis, RabbitMQ), the state rules and URLs."""
