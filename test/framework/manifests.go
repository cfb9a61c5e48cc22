package framework

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// DeployDir is the repository's deploy/ folder, whose kustomizations
// Kustomize renders.
func DeployDir() (string, error) {
	root := moduleRoot()
	if root == "" {
		return "", errors.New("framework: the repository's source is not on disk")
	}
	return filepath.Join(root, "deploy"), nil
}

// Kustomize renders the kustomization in dir with
// "$KUBEBUILDER_ASSETS/kubectl kustomize" (Kubectl) and returns its
// objects in the order kustomize wrote them.
func Kustomize(ctx context.Context, dir string) ([]*unstructured.Unstructured, error) {
	kubectl, err := Kubectl()
	if err != nil {
		return nil, err
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, kubectl, "kustomize", dir)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("framework: kubectl kustomize %s: %w: %s", dir, err, stderr.String())
	}
	return DecodeManifests(stdout.Bytes())
}

// DecodeManifests decodes a stream of YAML or JSON documents; empty ones
// are skipped.
func DecodeManifests(raw []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	var objs []*unstructured.Unstructured
	for {
		var m map[string]any
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("framework: decode manifests: %w", err)
		}
		if len(m) > 0 {
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
}

// Apply server-side applies objs to the cluster as its admin, for real, in
// the order given (a Namespace before what lives in it). The RBAC
// authorizer sees new bindings a moment later.
func (c *Cluster) Apply(ctx context.Context, objs []*unstructured.Unstructured) error {
	dc, err := discovery.NewDiscoveryClientForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("framework: %s: discovery: %w", c.Name, err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("framework: %s: dynamic client: %w", c.Name, err)
	}
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			mapper.Reset()
			if m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
				return fmt.Errorf("framework: %s: %s is not served: %w", c.Name, gvk, err)
			}
		}
		var r dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			r = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		if _, err := r.Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: "credbroker-framework", Force: true}); err != nil {
			return fmt.Errorf("framework: %s: apply %s %s/%s: %w", c.Name, o.GetKind(), o.GetNamespace(), o.GetName(), err)
		}
	}
	return nil
}

// WriteServiceAccountKubeconfig writes, in dir, a kubeconfig for the
// cluster that authenticates as the ServiceAccount namespace/name with a
// token valid for ttl (as a pod's projected token would), and returns its
// path. The ServiceAccount must exist.
func (c *Cluster) WriteServiceAccountKubeconfig(ctx context.Context, dir, namespace, name string, ttl time.Duration) (string, error) {
	tok, err := c.Token(ctx, namespace, name, nil, ttl)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, c.Name+"-"+namespace+"-"+name+".kubeconfig")
	if err := clientcmd.WriteToFile(clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{c.Name: {Server: c.Server, CertificateAuthorityData: c.CAData}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{name: {Token: tok}},
		Contexts:       map[string]*clientcmdapi.Context{c.Name: {Cluster: c.Name, AuthInfo: name}},
		CurrentContext: c.Name,
	}, path); err != nil {
		return "", fmt.Errorf("framework: write kubeconfig: %w", err)
	}
	return path, nil
}
