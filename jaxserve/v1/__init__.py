"""Python stubs generated from proto/jaxserve/v1/jaxserve.proto (see scripts/gen_proto.sh;
tests/test_proto.py checks that they match the proto)."""
