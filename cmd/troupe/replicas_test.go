package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// replicasRun runs `troupe replicas args...` as the CLI does.
func replicasRun(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(append([]string{"replicas"}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

// rowRE is a row of troupe replicas' table: stage, replica, state.
var rowRE = regexp.MustCompile(`(?m)^(\w+)\s+(\d+)\s+\d+\s+(attached|sleeping|unhealthy|detached)\s`)

// TestReplicasAgainstUp runs troupe replicas against a real head (troupe
// up): the table, the filters, the JSON, a watch that prints a replica
// put to sleep and ends cleanly on Ctrl-C, and the errors a user meets.
func TestReplicasAgainstUp(t *testing.T) {
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error", "--replicas", "2")
	base := up.wait(t, apiRE)
	up.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))

	// Up is ready once every stage is routable; the second replica of a
	// stage may still be on its join probe then.
	var stdout, stderr string
	var code int
	attached := func() bool {
		code, stdout, stderr = replicasRun("--url", base)
		n := 0
		for _, r := range rowRE.FindAllStringSubmatch(stdout, -1) {
			if r[3] == "attached" {
				n++
			}
		}
		return code == 0 && n == 6
	}
	require.Eventually(t, attached, 30*time.Second, 20*time.Millisecond, "two replicas of each of the three stages: %s %s", stdout, stderr)
	require.True(t, strings.HasPrefix(stdout, replicasHeader+"\n"), stdout)
	require.Len(t, rowRE.FindAllStringSubmatch(stdout, -1), 6, stdout)

	code, stdout, stderr = replicasRun("--url", base+"/v1", "--stage", "talker", "--json")
	require.Equal(t, 0, code, stderr)
	var list struct {
		Data []struct {
			StageName string `json:"stage_name"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &list), stdout)
	require.Len(t, list.Data, 2)
	for _, r := range list.Data {
		assert.Equal(t, "talker", r.StageName)
	}
	code, stdout, _ = replicasRun("--url", base, "--state", "detached")
	require.Equal(t, 0, code)
	assert.Equal(t, replicasHeader+"\n", stdout, "no replica has left")

	// A watch prints the table, then the replica put to sleep.
	watch := background(t, "replicas", runReplicas, "--url", base, "--watch", "--stage", "thinker")
	watch.wait(t, regexp.MustCompile(`(-- following)`))
	resp, err := http.Post(base+"/v1/replicas/thinker/0/sleep?level=1", "application/json", nil)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	watch.wait(t, regexp.MustCompile(`(?m)^\d\d:\d\d:\d\d\.\d{3} (thinker\s+0\s+\d+\s+sleeping)\s`))

	// What a user gets wrong.
	code, _, stderr = replicasRun("--url", base, "--state", "asleep")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "the head answered 400: state must be attached, sleeping, unhealthy or detached")
	code, _, stderr = replicasRun("--url", base, "--stage", "nope")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "the head answered 400")
	code, _, stderr = replicasRun("--url", base, "--watch", "--state", "attached")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "--state with --watch")
	code, _, stderr = replicasRun("--url", "http://127.0.0.1:1")
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "is the head at http://127.0.0.1:1?")
}
