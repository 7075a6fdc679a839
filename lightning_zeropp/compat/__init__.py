"""Every private or version-dependent symbol of torch, Lightning and Triton that lightning-zeropp uses, in one place."""
