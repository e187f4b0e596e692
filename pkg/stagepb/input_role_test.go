package stagepb_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestRoles(t *testing.T) {
	for _, r := range stagepb.Roles {
		got, err := stagepb.ParseRole(r)
		require.NoError(t, err)
		assert.Equal(t, r, got)
	}
	_, err := stagepb.ParseRole("video")
	assert.EqualError(t, err, `stagepb: unknown role "video" (want text, codes or audio)`)
	_, err = stagepb.ParseRole("")
	assert.Error(t, err)

	assert.Equal(t, stagepb.RoleCodes, stagepb.InputRoleOf(stagepb.RoleAudio))
	assert.Equal(t, stagepb.RoleText, stagepb.InputRoleOf(stagepb.RoleCodes))
	assert.Equal(t, stagepb.RoleText, stagepb.InputRoleOf(""))
	assert.Equal(t, stagepb.RoleCodes, (&stagepb.HealthResponse{Role: stagepb.RoleAudio}).EffectiveInputRole())
	assert.Equal(t, stagepb.RoleAudio, (&stagepb.HealthResponse{Role: stagepb.RoleAudio, InputRole: stagepb.RoleAudio}).EffectiveInputRole())
}
