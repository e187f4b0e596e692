package worker

import (
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAdvertiseAddr(t *testing.T) {
	host, err := os.Hostname()
	require.NoError(t, err)
	tcp := func(s string) net.Addr {
		a, err := net.ResolveTCPAddr("tcp", s)
		require.NoError(t, err)
		return a
	}
	for _, c := range []struct {
		bound, advertise, want string
	}{
		{"127.0.0.1:4321", "", "127.0.0.1:4321"},
		{"0.0.0.0:4321", "", net.JoinHostPort(host, "4321")},
		{"[::]:4321", "", net.JoinHostPort(host, "4321")},
		{"[::1]:4321", "", "[::1]:4321"},
		{"0.0.0.0:4321", "worker-3.example:9000", "worker-3.example:9000"},
		{"0.0.0.0:4321", "worker-3.example", "worker-3.example:4321"},
		{"0.0.0.0:4321", "worker-3.example:0", "worker-3.example:4321"},
		{"0.0.0.0:4321", "10.0.0.7", "10.0.0.7:4321"},
		{"0.0.0.0:4321", "fd00::7", "[fd00::7]:4321"},
		{"0.0.0.0:4321", "[fd00::7]", "[fd00::7]:4321"},
		{"0.0.0.0:4321", "[fd00::7]:80", "[fd00::7]:80"},
	} {
		got, err := advertiseAddr(tcp(c.bound), c.advertise)
		require.NoError(t, err, "%s %q", c.bound, c.advertise)
		assert.Equal(t, c.want, got, "%s %q", c.bound, c.advertise)
	}
	for _, bad := range []string{":9000", "a:b:c"} {
		_, err := advertiseAddr(tcp("127.0.0.1:1"), bad)
		assert.ErrorContains(t, err, "invalid --advertise", bad)
	}
}
