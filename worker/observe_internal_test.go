package worker

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestMetricsAddr: the record's metrics address takes the advertised
// host when --metrics-listen binds all interfaces, and is empty without it.
func TestMetricsAddr(t *testing.T) {
	for _, tc := range []struct{ listen, advertised, want string }{
		{"", "10.0.0.5:7000", ""},
		{"127.0.0.1:9100", "10.0.0.5:7000", "127.0.0.1:9100"},
		{":9100", "10.0.0.5:7000", "10.0.0.5:9100"},
		{"0.0.0.0:9100", "pod-a:7000", "pod-a:9100"},
		{"[::]:9100", "[fd00::1]:7000", "[fd00::1]:9100"},
		{"not-an-addr", "h:1", ""},
	} {
		assert.Equal(t, tc.want, metricsAddr(tc.listen, tc.advertised), "%q advertised as %q", tc.listen, tc.advertised)
	}
}
