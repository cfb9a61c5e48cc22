package clusterprofile

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

// A tombstone whose last known state is lost still names the key, and the
// callback hears of it with an empty UID. The informer never builds one in
// practice, so it is tested here, below the public API.
func TestOnDeleteTombstoneWithoutObject(t *testing.T) {
	i := &Index{td: spiffeid.RequireTrustDomainFromString("fleet.example")}
	var got []string
	i.OnChange(func(key types.NamespacedName, uid types.UID) {
		got = append(got, key.String()+" "+string(uid))
	})
	i.onDelete(cache.DeletedFinalStateUnknown{Key: "fleet/east-1"})
	i.onDelete(cache.DeletedFinalStateUnknown{Key: "a/b/c"}) // unusable key: logged, not reported
	i.onDelete("not a ClusterProfile")
	assert.Equal(t, []string{"fleet/east-1 "}, got)
}
