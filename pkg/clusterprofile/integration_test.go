package clusterprofile_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"
	"sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

// crdDir finds the ClusterProfile CRD in the cluster-inventory-api module.
func crdDir(t *testing.T) string {
	t.Helper()
	var dir string
	if out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/cluster-inventory-api").Output(); err == nil {
		dir = strings.TrimSpace(string(out))
	} else {
		// No go command: the compiled-in path of the module's source.
		pc := reflect.ValueOf((*v1alpha1.ClusterProfile).DeepCopy).Pointer()
		file, _ := runtime.FuncForPC(pc).FileLine(pc)
		if filepath.IsAbs(file) {
			dir = filepath.Join(filepath.Dir(file), "..", "..")
		}
	}
	crds := filepath.Join(dir, "config", "crd", "bases")
	if _, err := os.Stat(filepath.Join(crds, "multicluster.x-k8s.io_clusterprofiles.yaml")); dir == "" || err != nil {
		t.Fatalf("cannot find the ClusterProfile CRD of sigs.k8s.io/cluster-inventory-api (looked in %q): run go mod download", crds)
	}
	return crds
}

func TestIndexAgainstAPIServer(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Fatal("KUBEBUILDER_ASSETS is not set: run make testbin and point it at the folder it prints, or run make test")
	}
	// As test/framework does: a loaded 2-core machine starts an API server slowly.
	env := &envtest.Environment{CRDDirectoryPaths: []string{crdDir(t)}, ErrorIfCRDPathMissing: true, ControlPlaneStartTimeout: time.Minute}
	cfg, err := env.Start()
	require.NoError(t, err, "start kube-apiserver and etcd (run make testbin)")
	t.Cleanup(func() { assert.NoError(t, env.Stop()) })

	ctx := t.Context()
	client := versioned.NewForConfigOrDie(cfg).ApisV1alpha1().ClusterProfiles("default")
	factory := externalversions.NewSharedInformerFactory(versioned.NewForConfigOrDie(cfg), 0)
	logs := &logs{}
	idx, err := clusterprofile.New(clusterprofile.Config{
		Informer:    factory.Apis().V1alpha1().ClusterProfiles().Informer(),
		TrustDomain: td,
		Log:         logs.logger(),
	})
	require.NoError(t, err)
	changes := &changes{}
	idx.OnChange(changes.record)
	factory.Start(ctx.Done())
	t.Cleanup(factory.Shutdown)
	require.True(t, cache.WaitForCacheSync(ctx.Done(), idx.HasSynced))

	create := func(cp *v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile {
		t.Helper()
		cp.Namespace = "default"
		got, err := client.Create(ctx, cp, metav1.CreateOptions{})
		require.NoError(t, err)
		return got
	}
	// forAgent waits until ForAgent(id) answers with want's name and UID, or
	// with an error containing wantErr.
	forAgent := func(id, want string, uid types.UID, wantErr string) {
		t.Helper()
		var err error
		var cp *v1alpha1.ClusterProfile
		ok := assert.Eventually(t, func() bool {
			cp, err = idx.ForAgent(idOf(id))
			if wantErr != "" {
				return err != nil && strings.Contains(err.Error(), wantErr)
			}
			return err == nil && cp.Name == want && cp.UID == uid
		}, 10*time.Second, 10*time.Millisecond)
		if !ok {
			t.Fatalf("ForAgent(%s) = %v, %v", id, cp, err)
		}
		if wantErr != "" {
			assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		}
	}
	changed := func(key string, uid types.UID) {
		t.Helper()
		var seen []string
		require.Eventually(t, func() bool {
			seen = append(seen, changes.take()...)
			return slices.Contains(seen, key+" "+string(uid))
		}, 10*time.Second, 10*time.Millisecond, "OnChange(%s, %s); saw %q", key, uid, seen)
	}

	const eastID, westID = "spiffe://fleet.example/clusterprofile/default/east", "spiffe://fleet.example/agents/west"

	east := create(profile("", "east"))
	west := create(profile("", "west", westID))
	create(profile("", "bad", "spiffe://other.example/agents/bad"))

	t.Run("lookups", func(t *testing.T) {
		forAgent(eastID, "east", east.UID, "")
		forAgent(westID, "west", west.UID, "")
		// The annotation replaces the default ID.
		forAgent("spiffe://fleet.example/clusterprofile/default/west", "", "", "no ClusterProfile accepts agent")
		forAgent("spiffe://fleet.example/clusterprofile/default/bad", "", "", "no ClusterProfile accepts agent")
		forAgent("spiffe://other.example/agents/bad", "", "", "outside trust domain fleet.example")

		cp, err := idx.Get("default", "west")
		require.NoError(t, err)
		assert.Equal(t, west.UID, cp.UID)
		_, err = idx.Get("default", "north")
		assert.EqualError(t, err, "clusterprofile default/north not found")
		assert.ErrorIs(t, err, errdefs.ErrNotFound)

		require.Eventually(t, func() bool { return len(logs.get()) > 0 }, 10*time.Second, 10*time.Millisecond)
		assert.Contains(t, logs.get()[0], `"clusterprofile"="default/bad"`)
	})

	t.Run("access through the status subresource", func(t *testing.T) {
		cp := east.DeepCopy()
		cp.Status.AccessProviders = []v1alpha1.AccessProvider{{
			Name:    "kubeconfig",
			Cluster: clientcmdv1.Cluster{Server: "https://east.example:6443", CertificateAuthorityData: []byte("east CA")},
		}}
		cp.Status.CredentialProviders = []v1alpha1.AccessProvider{{
			Name:    "kubeconfig",
			Cluster: clientcmdv1.Cluster{Server: "https://old-east.example:6443"},
		}}
		east, err = client.UpdateStatus(ctx, cp, metav1.UpdateOptions{})
		require.NoError(t, err)
		changed("default/east", east.UID)
		require.Eventually(t, func() bool {
			cp, err := idx.Get("default", "east")
			return err == nil && cp.ResourceVersion == east.ResourceVersion
		}, 10*time.Second, 10*time.Millisecond)
		cp, err = idx.Get("default", "east")
		require.NoError(t, err)
		server, ca, ok := clusterprofile.Access(cp, "kubeconfig")
		assert.True(t, ok)
		assert.Equal(t, "https://east.example:6443", server)
		assert.Equal(t, "east CA", string(ca))
	})

	var heir *v1alpha1.ClusterProfile
	t.Run("claims", func(t *testing.T) {
		// Another profile's default ID is out of reach of an annotation.
		rogue := create(profile("", "rogue", eastID))
		require.Eventually(t, func() bool { _, err := idx.Get("default", "rogue"); return err == nil }, 10*time.Second, 10*time.Millisecond)
		forAgent(eastID, "east", east.UID, "")
		cp, err := idx.Get("default", "rogue")
		require.NoError(t, err)
		err = idx.CheckAgent(cp)
		assert.ErrorContains(t, err, "lies under the reserved path /clusterprofile/")
		assert.ErrorIs(t, err, errdefs.ErrFailedPrecondition)
		require.NoError(t, client.Delete(ctx, rogue.Name, metav1.DeleteOptions{}))

		// A later claim on an annotated ID leaves it with its holder.
		// creationTimestamp counts whole seconds, and within one second the
		// lower UID would hold the ID: claim it a second later.
		time.Sleep(time.Until(west.CreationTimestamp.Add(1100 * time.Millisecond)))
		heir = create(profile("", "heir", westID))
		require.True(t, heir.CreationTimestamp.After(west.CreationTimestamp.Time))
		changed("default/west", west.UID) // west shares an ID with the newcomer
		forAgent(westID, "west", west.UID, "")
		cp, err = idx.Get("default", "heir")
		require.NoError(t, err)
		err = idx.CheckAgent(cp)
		assert.ErrorContains(t, err, "which clusterprofile default/west claimed first and holds")
		assert.ErrorIs(t, err, errdefs.ErrFailedPrecondition)
	})

	t.Run("deletion with a finalizer", func(t *testing.T) {
		cp := west.DeepCopy()
		cp.Finalizers = []string{"credbroker.io/test"}
		west, err = client.Update(ctx, cp, metav1.UpdateOptions{})
		require.NoError(t, err)
		require.NoError(t, client.Delete(ctx, "west", metav1.DeleteOptions{}))
		changed("default/west", west.UID)
		// The terminating holder keeps its ID: heir does not inherit it.
		forAgent(westID, "", "", "belongs to clusterprofile default/west, which is being deleted")
		require.Eventually(t, func() bool {
			_, err := idx.Get("default", "west")
			return errors.Is(err, errdefs.ErrNotFound)
		}, 10*time.Second, 10*time.Millisecond)
		still, err := client.Get(ctx, "west", metav1.GetOptions{})
		require.NoError(t, err, "the finalizer holds the object")
		require.NotNil(t, still.DeletionTimestamp)

		still.Finalizers = nil
		_, err = client.Update(ctx, still, metav1.UpdateOptions{})
		require.NoError(t, err)
		changed("default/west", west.UID)
		_, err = client.Get(ctx, "west", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "%v", err)
		// Once the holder is gone, the next claimant holds the ID.
		forAgent(westID, "heir", heir.UID, "")
		require.NoError(t, client.Delete(ctx, "heir", metav1.DeleteOptions{}))
	})

	t.Run("delete and recreate", func(t *testing.T) {
		require.NoError(t, client.Delete(ctx, "east", metav1.DeleteOptions{}))
		changed("default/east", east.UID)
		forAgent(eastID, "", "", "no ClusterProfile accepts agent "+eastID)
		_, err := idx.Get("default", "east")
		assert.EqualError(t, err, "clusterprofile default/east not found")

		again := create(profile("", "east"))
		require.NotEqual(t, east.UID, again.UID)
		forAgent(eastID, "east", again.UID, "")
		cp, err := idx.Get("default", "east")
		require.NoError(t, err)
		assert.Equal(t, again.UID, cp.UID)
		_, _, ok := clusterprofile.Access(cp, "kubeconfig")
		assert.False(t, ok, "the new ClusterProfile has no status yet")
	})

}
