"""GPU registry: device inventory from per-node monitors and the reservation ledger."""
