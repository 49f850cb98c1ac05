"""The trader service: Gandiva_fair second-price GPU trading on heterogeneous clusters."""
