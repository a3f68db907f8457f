"""FedShard on Lightning Fabric."""
