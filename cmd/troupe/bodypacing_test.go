package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestUpBodyPacing: --body-idle-timeout reaches the API: a body that stops
// arriving is answered 408 body_too_slow once the pause passes the flag's
// bound, and a bound that is not positive is refused at start.
func TestUpBodyPacing(t *testing.T) {
	err := runUp(context.Background(), []string{"--body-idle-timeout", "0s"}, io.Discard)
	assert.ErrorContains(t, err, "--body-idle-timeout")

	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error", "--body-idle-timeout", "300ms")
	base := up.wait(t, apiRE)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", strings.TrimPrefix(base, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	require.NoError(t, conn.SetDeadline(deadline))
	// Headers promising 1000 bytes, then a few, then nothing.
	_, err = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: troupe\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
	require.NoError(t, err)
	sent := time.Now()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err, "the head answers a stalled body itself")
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, http.StatusRequestTimeout, resp.StatusCode, "%s", body)
	assert.Contains(t, string(body), "body_too_slow")
	assert.GreaterOrEqual(t, time.Since(sent), 300*time.Millisecond, "not before the pause passed the bound")
}
