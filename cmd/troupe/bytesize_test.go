package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestByteSize(t *testing.T) {
	for in, want := range map[string]int64{"16MiB": 16 << 20, "1048576": 1 << 20, "10MB": 10e6, "2 KiB": 2048, "7B": 7} {
		var b byteSize
		require.NoError(t, b.Set(in), in)
		assert.Equal(t, want, int64(b), in)
	}
	for _, in := range []string{"", "-1", "0", "MiB", "1.5MiB", "12XB"} {
		var b byteSize
		assert.Error(t, b.Set(in), in)
	}
	b := byteSize(16 << 20)
	assert.Equal(t, "16MiB", b.String())
}
