package worker_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// record reads the replica's member record from etcd; ok is false when
// the key is absent.
func record(t *testing.T, cli *clientv3.Client, stage string, id uint32) (membership.Member, bool) {
	t.Helper()
	key := membership.MemberKey(membership.DefaultCluster, stage, id)
	got, err := cli.Get(testCtx(t), key)
	require.NoError(t, err)
	if len(got.Kvs) == 0 {
		return membership.Member{}, false
	}
	m, err := membership.DecodeMember(membership.DefaultCluster, key, got.Kvs[0].Value)
	require.NoError(t, err)
	return m, true
}

// TestSleepStateIsInTheRecord: the record starts awake, and a Sleep or
// WakeUp answers only once etcd holds the new state, which is how every
// head learns it.
func TestSleepStateIsInTheRecord(t *testing.T) {
	cli := membershiptest.Start(t).Client(t)
	r := start(t, worker.Config{Stage: "thinker", ReplicaID: 2, EtcdClient: cli, Engine: newSim(t, sim.Config{})})
	r.waitRegistered(t)
	m, ok := record(t, cli, "thinker", 2)
	require.True(t, ok)
	assert.Equal(t, "awake", m.SleepState)
	started := m.StartedAt

	sc := dial(t, r.Advertise())
	resp, err := sc.Sleep(testCtx(t), &stagepb.SleepRequest{Level: 2})
	require.NoError(t, err)
	require.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, resp.GetSleepState())
	m, _ = record(t, cli, "thinker", 2)
	assert.Equal(t, "discard_all", m.SleepState)
	assert.Equal(t, started, m.StartedAt, "the same record, changed")

	w, err := sc.WakeUp(testCtx(t), &stagepb.WakeUpRequest{})
	require.NoError(t, err)
	require.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, w.GetSleepState())
	m, _ = record(t, cli, "thinker", 2)
	assert.Equal(t, "awake", m.SleepState)

	// A refused sleep (bad level) changes nothing.
	_, err = sc.Sleep(testCtx(t), &stagepb.SleepRequest{Level: 3})
	require.Error(t, err)
	m, _ = record(t, cli, "thinker", 2)
	assert.Equal(t, "awake", m.SleepState)
	assert.NoError(t, r.stop(t))
}

// TestDrainRPCDeregisters: the Drain RPC removes the record, so every head
// stops routing here, while in-flight work goes on.
func TestDrainRPCDeregisters(t *testing.T) {
	cli := membershiptest.Start(t).Client(t)
	g := newGated(newSim(t, sim.Config{}))
	r := start(t, worker.Config{Stage: "talker", ReplicaID: 0, EtcdClient: cli, Engine: g})
	r.waitRegistered(t)
	_, ok := record(t, cli, "talker", 0)
	require.True(t, ok)

	sc := dial(t, r.Advertise())
	stream, err := sc.Generate(testCtx(t), textReq("in flight", &stagepb.SamplingParams{MaxTokens: 10, IgnoreEos: true}))
	require.NoError(t, err)
	g.waitHeld(t)
	d, err := sc.Drain(testCtx(t), &stagepb.DrainRequest{})
	require.NoError(t, err)
	assert.Equal(t, uint32(1), d.GetInFlight())
	_, ok = record(t, cli, "talker", 0)
	assert.False(t, ok, "the record is gone once Drain answered")

	close(g.gate)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, chunks[len(chunks)-1].GetFinishReason())
	assert.NoError(t, r.stop(t))
}
