package spoke

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"
)

// A broker replica whose stream was down when a grant went learns of it
// from the next stream: the Minter remembers the removals of grants whose
// tokens have not expired, until they expire.
func TestRemovedRemembersTheRemovalsOfLiveTokens(t *testing.T) {
	minted := profileGrant("apps", "g", "deployer", argocd, "fleet/a") // expires at issuedAt+30m
	rewritten := minted.DeepCopy()
	rewritten.Annotations[GrantCredentialIDAnnotation] = "JTI=other"
	pulledIn := minted.DeepCopy()
	pulledIn.Annotations[GrantExpirationAnnotation] = issuedAt.Add(-time.Hour).Format(time.RFC3339)
	tests := []struct {
		name  string
		event func(h cache.ResourceEventHandler)
		after time.Duration // how long after issuedAt Removed is asked
		want  []string
	}{
		{name: "deleted", event: func(h cache.ResourceEventHandler) { h.OnDelete(minted) }, want: []string{"JTI=jti-g"}},
		{name: "deleted, asked once its token expired", event: func(h cache.ResourceEventHandler) { h.OnDelete(minted) }, after: 30 * time.Minute},
		{name: "deleted, asked just before its token expires", event: func(h cache.ResourceEventHandler) { h.OnDelete(minted) }, after: 30*time.Minute - time.Second,
			want: []string{"JTI=jti-g"}},
		{name: "deleted while the watch was down", event: func(h cache.ResourceEventHandler) {
			h.OnDelete(cache.DeletedFinalStateUnknown{Key: "apps/g", Obj: minted})
		}, want: []string{"JTI=jti-g"}},
		{name: "credential id rewritten, then deleted", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, rewritten); h.OnDelete(rewritten) },
			want: []string{"JTI=jti-g"}},
		// Someone else writes an expiry in the past: the removal is kept
		// until the token's own expiry, as the agent wrote it.
		{name: "expiry pulled in, then deleted", event: func(h cache.ResourceEventHandler) { h.OnUpdate(minted, pulledIn); h.OnDelete(pulledIn) },
			want: []string{"JTI=jti-g"}},
		{name: "added", event: func(h cache.ResourceEventHandler) { h.OnAdd(minted, false) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := testingclock.NewFakeClock(issuedAt)
			m := grantsMinter(t, newFakeGrants(), func(c *Config) { c.Clock = clk })
			tt.event(m.GrantEvents())
			clk.Step(tt.after)
			assert.Equal(t, tt.want, nilIfEmpty(m.Removed()))
		})
	}
}

// A removal is told for at most the agent's maximum token lifetime after
// a hello first tells it, whatever expiry its grant shows.
func TestRemovedForgetsAStretchedExpiry(t *testing.T) {
	stretched := profileGrant("apps", "g", "deployer", argocd, "fleet/a")
	stretched.Annotations[GrantExpirationAnnotation] = issuedAt.Add(24 * time.Hour).Format(time.RFC3339)
	clk := testingclock.NewFakeClock(issuedAt)
	m := grantsMinter(t, newFakeGrants(), func(c *Config) { c.Clock = clk })
	m.GrantEvents().OnDelete(stretched)
	assert.Equal(t, []string{"JTI=jti-g"}, m.Removed())
	clk.Step(time.Hour - time.Second)
	assert.Equal(t, []string{"JTI=jti-g"}, m.Removed())
	clk.Step(time.Second)
	assert.Empty(t, m.Removed())
}

// Past maxRemembered removals, those whose tokens expire last are kept.
func TestRemovedIsBounded(t *testing.T) {
	var r removals
	for i := range maxRemembered + 10 {
		r.add(fmt.Sprintf("JTI=%05d", i), issuedAt.Add(time.Minute+time.Duration(i)*time.Second))
	}
	r.add("JTI=soonest", issuedAt.Add(time.Second))
	got := r.list(issuedAt, 24*time.Hour)
	assert.Len(t, got, maxRemembered)
	assert.Equal(t, "JTI=00010", got[0], "the removals expiring first are forgotten first")
	assert.NotContains(t, got, "JTI=soonest")
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}
