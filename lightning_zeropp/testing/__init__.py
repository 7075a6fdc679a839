"""Support for the tests of lightning-zeropp and of projects built on it: small models, spawned gloo ranks."""
