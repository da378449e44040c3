"""Everything that moves bytes: devices, transfer ops, host pool, residency manager."""
